"""The KV cache: the block manager and its prefix cache of chained, salted block
hashes, the events it reports, and int8 KV scales with their calibration."""
