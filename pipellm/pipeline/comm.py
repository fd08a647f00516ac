"""Point-to-point messaging over torch.distributed (gloo). World rank 0 is the driver; stage i is rank i + 1."""
import pickle
from datetime import timedelta

import torch
import torch.distributed as dist

DRIVER = 0
FOREVER = timedelta(days=365)


def stage_world_rank(stage: int) -> int:
    return stage + 1


def make_store(host: str, port: int, world_size: int, is_master: bool, timeout_s: float = 60.0) -> dist.TCPStore:
    """Rendezvous and side channel (readiness, errors). port=0 on the master picks a free port."""
    return dist.TCPStore(host, port, world_size, is_master=is_master, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def make_channel(store: dist.Store, world_rank: int, world_size: int) -> "Channel":
    # A process group object of our own rather than the default group: the user's process may
    # hold several engines, or a default group of its own.
    return Channel(dist.ProcessGroupGloo(store, world_rank, world_size, FOREVER))


class Channel:
    """Sends tensors and picklable messages to one peer at a time; sends are async, receives block."""

    def __init__(self, pg: dist.ProcessGroup):
        self.pg = pg
        self._pending: list[tuple[object, torch.Tensor]] = []  # (work, tensor kept alive until sent)

    def send_tensor(self, tensor: torch.Tensor, dst: int) -> None:
        tensor = tensor.contiguous()
        self._pending = [(w, t) for w, t in self._pending if not w.is_completed()]
        self._pending.append((self.pg.send([tensor], dst, 0), tensor))

    def recv_tensor(self, shape, dtype: torch.dtype, src: int, timeout: timedelta = FOREVER) -> torch.Tensor:
        tensor = torch.empty(shape, dtype=dtype)
        self.pg.recv([tensor], src, 0).wait(timeout)
        return tensor

    def send_obj(self, obj, dst: int) -> None:
        payload = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
        self.send_tensor(torch.tensor([payload.numel()], dtype=torch.int64), dst)
        self.send_tensor(payload, dst)

    def recv_obj(self, src: int, timeout: timedelta = FOREVER):
        size = int(self.recv_tensor((1,), torch.int64, src, timeout)[0])
        return pickle.loads(self.recv_tensor((size,), torch.uint8, src, timeout).numpy().tobytes())

    def flush(self, timeout: timedelta = FOREVER) -> None:
        for work, _ in self._pending:
            work.wait(timeout)
        self._pending.clear()
