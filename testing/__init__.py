"""pdserve.testing: what tests and benchmarks share: polling waits (``waits``), throwaway TLS
certificates (``certificates``), chat templates (``chat_templates``), random paged-KV batches
for kernels (``paged_batches``), a model-free generation backend and an in-memory Admin
backend (``fake_backend``, ``fake_admin``), the check that a stream is its request's draws
(``draw_check``) and an engine on general steps only (``general_steps``).

No module here imports a test-only dependency (transformers, cryptography, pytest) when it is
imported: each imports it where it is used, so benchmarks can use the rest without them."""
