"""A follower rank's process: ``python -m pdserve.engine.tensor_parallel.follower_main --store
HOST:PORT --rank R --size N``, started by its rank 0 (``group.Followers.start``), which hands
it the group's key in ``SECRET_ENV``.

Without the key it exits at once (exit 2, naming the variable), before torch and the engine
load; with it, it serves as ``follower.py`` says.
"""

from __future__ import annotations

import argparse
import logging
import os

SECRET_ENV = "PDSERVE_TENSOR_GROUP_SECRET"  # how rank 0 hands its followers the group's key


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", required=True, help="rank 0's store, HOST:PORT")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--size", type=int, required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s tp-rank-{args.rank} %(levelname)s %(message)s")
    secret = os.environ.pop(SECRET_ENV, "")
    if not secret:
        parser.error(f"{SECRET_ENV} is not set: followers are started by their rank 0")
    # lazy: torch and the engine load only in a follower its rank 0 started
    from pdserve.engine.tensor_parallel.follower import run_follower

    run_follower(args.store, args.rank, args.size, bytes.fromhex(secret))


if __name__ == "__main__":
    main()
