"""The pure core: what the operator decides, and nothing it does. No API client, no processes,
no sockets, no clock of its own (the pass is given ``now``).

:func:`~ddpjob_operator.core.reconcile.reconcile` decides a job's pass from what was observed
of it; its rules live in rooms (accounting, verdict, holding, storehost, running, facts), beside
Kueue's side (:mod:`~ddpjob_operator.core.queue`), the per-index back-off
(:mod:`~ddpjob_operator.core.backoff`), the gang (:mod:`~ddpjob_operator.core.gang`) and the
words a pass tells (:mod:`~ddpjob_operator.core.events`).
"""
