"""pdserve.workers: any role built and hosted in this process, above the three roles and below
the cluster: ``build`` (:func:`build_worker`, the one builder of every role, which a Ray worker
actor runs in its own process too; :func:`build_local_workers`; how KV moves between them) and
``host`` (``WorkerHost``, a worker's calls awaitable with the calling router named;
``LocalHandle``, the in-process ``WorkerHandle``)."""
