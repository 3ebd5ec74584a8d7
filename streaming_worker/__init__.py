"""pdserve.streaming_worker: what the decode and colocated workers share, the streaming half of
a worker: an engine stepping on its loop thread that takes prompts to prefill itself
(``submit``), per-router mailboxes of its deltas (``mailboxes``) and the orphan clock that
frees the requests of a router gone silent."""
