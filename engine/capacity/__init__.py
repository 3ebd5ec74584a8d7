"""What a worker can hold and how fast it can go: memory planning (weights, KV pool,
activations), the budget check run before a worker starts, and the roofline.
Every worker and the capacity planner (``pdserve plan``) read them."""
