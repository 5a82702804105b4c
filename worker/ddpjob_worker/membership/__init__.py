"""The membership core: who is in a round, who is alive, who is cut, and which store is the
job's. No torch and no worker processes: one process runs hundreds of agents' cores (the
hollow agents of the scale benchmarks).

The hub (:mod:`~ddpjob_worker.membership.hub`, on the store's host) is the single writer of
rounds; each agent is one :mod:`~ddpjob_worker.membership.member` of it over
:mod:`~ddpjob_worker.membership.wire`. Failover and fencing are pure rules
(:mod:`~ddpjob_worker.membership.failover`).
"""
