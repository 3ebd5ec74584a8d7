"""pdserve.colocated_worker: one engine runs both phases, chunked prefill mixed into its decode
steps (the baseline every disaggregated figure is measured against)."""
