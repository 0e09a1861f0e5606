"""Rolling changes across a fleet: batches (``--serial``), a stop on failures
(``--max-fail``), a gated canary (``--canary``) and putting failed hosts back
(``--rollback-on-failure``). :mod:`.plan` decides the batches, :mod:`.gate` judges a canary,
:mod:`.executor` carries a :class:`~.executor.HostChange` out, :mod:`.changes` holds the
changes of ``restart``, ``deploy``, ``tune --deploy`` and ``rollback``.
"""
