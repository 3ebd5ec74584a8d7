"""Third-party load tools (aiperf, guidellm, inference-perf) against pdserve's OpenAI HTTP door:
``setup.sh`` installs them, ``run.sh`` runs one, :mod:`.summary` tabulates their reports beside
``pdserve bench serve``'s (docs/benchmarking.md)."""
