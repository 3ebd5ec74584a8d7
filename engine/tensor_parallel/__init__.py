"""One engine computed by a group of ranks: rank 0's group and runner
(``group``) and the follower processes (``follower``). Which part of each
weight a rank holds is the model's business: ``pdserve.models.tensor_parallel``."""
