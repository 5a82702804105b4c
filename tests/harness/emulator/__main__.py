"""``python -m tests.harness.emulator``: run the emulator until SIGTERM (see runner.main)."""

from tests.harness.emulator.runner import main

main()
