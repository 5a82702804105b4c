"""``ddpjob-agent``: torchrun's agent with ddpjob's recovery policy, and its process side.

:mod:`~ddpjob_worker.agent.cli` is the entry point; :mod:`~ddpjob_worker.agent.launch` starts
the agent (:mod:`~ddpjob_worker.agent.elastic`) on the store that carries the job. The agent
imports torch (its modules that do not are pure rules: ``policy``, ``ledger``, ``blame``) and
uses the membership core (:mod:`ddpjob_worker.membership`); it never imports the training
library (:mod:`ddpjob_worker.train`), which runs in the workers.
"""
