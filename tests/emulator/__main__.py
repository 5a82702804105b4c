"""``python -m tests.emulator``: run the emulator until SIGTERM (see runner.main)."""

from tests.emulator.runner import main

main()
