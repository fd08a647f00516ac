"""Point-to-point messaging over torch.distributed (gloo). World rank 0 is the driver; stage i is rank i + 1."""
import os
import pickle
import socket
from collections import deque
from datetime import timedelta

import torch
import torch.distributed as dist

DRIVER = 0
HEARTBEAT_S = 0.5  # how often a stage tells the driver it is still there
FOREVER = timedelta(days=365)


def stage_world_rank(stage: int) -> int:
    return stage + 1


def make_store(host: str, port: int, is_master: bool, timeout_s: float = 60.0) -> dist.TCPStore:
    """Rendezvous and side channel (plan, readiness, errors, heartbeats). port=0 on the master picks a free port.
    A client retries connecting for timeout_s, so a stage may start before the driver listens."""
    return dist.TCPStore(host, port, is_master=is_master, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=False)


# Keys of the rendezvous store. Each pipeline (a first start or a restart after a failure) is a new generation whose
# keys, process group included, live under a prefix of their own, so a restarted pipeline never reads stale ones.
GENERATION_KEY = "pipellm/generation"  # the newest generation; stages and node agents start on it
NNODES_KEY = "pipellm/nnodes"
SHUTDOWN_KEY = "pipellm/shutdown"      # the driver is done: node agents exit


def agent_key(node_rank: int) -> str:  # a counter the node agent of a host bumps while it runs
    return f"pipellm/agent/{node_rank}"


def bye_key(node_rank: int) -> str:  # set by a node agent that saw the driver's shutdown
    return f"pipellm/bye/{node_rank}"


def generation_store(store: dist.Store, generation: int) -> dist.Store:
    return dist.PrefixStore(f"pipellm/{generation}/", store)


def args_key(rank: int) -> str:      # pickled StageArgs of stage `rank`
    return f"args/{rank}"


def ready_key(rank: int) -> str:     # JSON {"pid", "host"} once loaded
    return f"ready/{rank}"


def error_key(rank: int) -> str:     # JSON {"type", "message", "traceback"} of a failed stage
    return f"error/{rank}"


def exit_key(rank: int) -> str:      # return code of a stage that ended, written by its node agent
    return f"exit/{rank}"


def heartbeat_key(rank: int) -> str:  # a counter the stage bumps every HEARTBEAT_S
    return f"heartbeat/{rank}"


ABORT_KEY = "abort"                  # this generation failed: node agents kill its stages


def local_address(peer: str) -> str:
    """This host's address on the route to peer: the one other hosts reach this process at. (By default gloo
    listens on whatever the hostname resolves to, often a loopback address.)"""
    family, _, _, _, addr = socket.getaddrinfo(peer, 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(addr)  # UDP: picks the route, sends nothing
        return s.getsockname()[0]


def max_pending_sends(world_rank: int, num_stages: int, batches_in_flight: int) -> int:
    """How many sends a process may leave unwaited, such that the older ones are sure to have been received.

    The driver submits batch b only after the result of batch b - B is back (B batches in flight), so by then
    every process has received all it was sent for batch b - B. The driver sends each stage a message per batch,
    a stage one tensor (the last: one result) per batch; each message is at most two sends (mailbox, overflow),
    and one more batch's worth covers a stage report."""
    per_batch = 2 * num_stages if world_rank == DRIVER else 2
    return per_batch * (batches_in_flight + 1)


def make_channel(store: dist.Store, world_rank: int, num_stages: int, master_addr: str,
                 batches_in_flight: int) -> "Channel":
    # A process group object of our own rather than the default group: the user's process may
    # hold several engines, or a default group of its own.
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout, opts._threads = FOREVER, 2
    ifname = os.environ.get("GLOO_SOCKET_IFNAME")  # the user's choice of interface wins
    opts._devices = [dist.ProcessGroupGloo.create_device(interface=ifname) if ifname else
                     dist.ProcessGroupGloo.create_device(hostname=local_address(master_addr))]
    pg = dist.ProcessGroupGloo(store, world_rank, num_stages + 1, opts)
    return Channel(pg, max_pending_sends(world_rank, num_stages, batches_in_flight))


# Tags keep the three kinds of traffic apart, so a receive posted early matches only its own kind.
TAG_MESSAGE, TAG_OVERFLOW, TAG_TENSOR = 0, 1, 2
MAILBOX_BYTES = 32 * 1024  # one message of this size holds a whole decode batch
SEND_TIMEOUT = timedelta(seconds=60)  # for a send that should be done already: not answering means a dead peer


class Channel:
    """Sends tensors and picklable messages to one peer at a time; sends are async, receives block.

    Messages go in fixed-size mailbox tensors whose receive is posted ahead of time. A gloo receive
    posted after the data was sent costs a round trip to the sender, and the sender's I/O thread may
    be waiting behind its own compute for a core: several ms on the critical path of every step.
    """

    def __init__(self, pg: dist.ProcessGroup, max_pending: int):
        self.pg = pg
        # (work, tensor kept alive until sent). A gloo send reports completion only once waited on, so sends are
        # waited on, oldest first, once more than max_pending are out: by then they are received, and the wait is
        # instant (see max_pending_sends). Without it, every message sent would be kept.
        self._pending: deque[tuple[object, torch.Tensor]] = deque()
        self.max_pending = max_pending
        self._posted: dict[int, tuple[object, torch.Tensor]] = {}  # src -> (work, mailbox) received into next

    def send_tensor(self, tensor: torch.Tensor, dst: int, tag: int = TAG_TENSOR) -> None:
        tensor = tensor.contiguous()
        self._pending.append((self.pg.send([tensor], dst, tag), tensor))
        while len(self._pending) > self.max_pending:
            self._pending.popleft()[0].wait(SEND_TIMEOUT)

    def recv_tensor(self, shape, dtype: torch.dtype, src: int, timeout: timedelta = FOREVER,
                    tag: int = TAG_TENSOR) -> torch.Tensor:
        tensor = torch.empty(shape, dtype=dtype)
        self.pg.recv([tensor], src, tag).wait(timeout)
        return tensor

    def send_obj(self, obj, dst: int) -> None:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        mailbox = torch.zeros(MAILBOX_BYTES, dtype=torch.uint8)
        head = len(data).to_bytes(8, "little") + data[:MAILBOX_BYTES - 8]
        mailbox[:len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
        self.send_tensor(mailbox, dst, TAG_MESSAGE)
        if len(data) > MAILBOX_BYTES - 8:
            self.send_tensor(torch.frombuffer(bytearray(data[MAILBOX_BYTES - 8:]), dtype=torch.uint8), dst,
                             TAG_OVERFLOW)

    def post_recv(self, src: int) -> None:
        """Posts the receive of the next message from src, if not posted yet."""
        if src not in self._posted:
            mailbox = torch.empty(MAILBOX_BYTES, dtype=torch.uint8)
            self._posted[src] = (self.pg.recv([mailbox], src, TAG_MESSAGE), mailbox)

    def recv_obj(self, src: int, timeout: timedelta = FOREVER):
        self.post_recv(src)
        work, mailbox = self._posted.pop(src)
        work.wait(timeout)
        self.post_recv(src)
        raw = mailbox.numpy().tobytes()
        size = int.from_bytes(raw[:8], "little")
        data = raw[8:8 + size]
        if size > MAILBOX_BYTES - 8:
            data += self.recv_tensor((size - (MAILBOX_BYTES - 8),), torch.uint8, src, timeout,
                                     TAG_OVERFLOW).numpy().tobytes()
        return pickle.loads(data)

    def flush(self, timeout: timedelta = FOREVER) -> None:
        for work, _ in self._pending:
            work.wait(timeout)
        self._pending.clear()
