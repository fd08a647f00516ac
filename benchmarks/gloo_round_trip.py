"""What a driver-stage message costs on this host: two processes ping-pong a message over a gloo process group
(the transport pipellm's stages use), the answering side "computing" for --compute-ms in between, as a stage does.

    python benchmarks/gloo_round_trip.py [--bytes 32768] [--compute-ms 5] [--rounds 300]
Prints the median time of the send call and of a round trip less the compute time.
"""
import argparse
import os
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bytes", type=int, default=32 * 1024)  # comm.MAILBOX_BYTES
    parser.add_argument("--compute-ms", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=300)
    args = parser.parse_args()
    timeout = timedelta(seconds=60)
    master = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=timeout, wait_for_workers=False)  # a free port
    rank = 1 if os.fork() == 0 else 0
    store = master if rank == 0 else dist.TCPStore("127.0.0.1", master.port, 2, False, timeout=timeout)
    pg = dist.ProcessGroupGloo(store, rank, 2, timeout)
    out, into = torch.zeros(args.bytes, dtype=torch.uint8), torch.empty(args.bytes, dtype=torch.uint8)
    sends, trips = [], []
    for _ in range(args.rounds):
        if rank == 0:
            start = time.perf_counter()
            work = pg.send([out], 1, 0)
            sends.append(time.perf_counter() - start)
            pg.recv([into], 1, 0).wait()
            trips.append(time.perf_counter() - start - args.compute_ms / 1e3)
            work.wait()
        else:
            pg.recv([into], 0, 0).wait()
            time.sleep(args.compute_ms / 1e3)
            pg.send([out], 0, 0).wait()
    if rank == 1:
        os._exit(0)
    os.wait()
    print(f"{args.bytes} bytes: send call {statistics.median(sends) * 1e6:.0f} us, round trip beyond the compute "
          f"{statistics.median(trips) * 1e6:.0f} us (medians of {args.rounds})")


if __name__ == "__main__":
    main()
