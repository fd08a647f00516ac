"""Point-to-point messaging over torch.distributed: gloo, and NCCL for activations between two GPUs. World rank 0
is the driver; stage i is rank i + 1."""
import logging
import os
import socket
from collections import deque
from datetime import timedelta

import torch
import torch.distributed as dist

from pipellm import device
from pipellm.pipeline import wire

log = logging.getLogger("pipellm")
DRIVER = 0
HEARTBEAT_S = 0.5  # how often a stage tells the driver it is still there
FOREVER = timedelta(days=365)


def stage_world_rank(stage: int) -> int:
    return stage + 1


def peer_name(world_rank: int) -> str:
    return "the driver" if world_rank == DRIVER else f"stage {world_rank - 1}"


def make_store(host: str, port: int, is_master: bool, timeout_s: float = 60.0) -> dist.TCPStore:
    """Rendezvous and side channel (plan, readiness, errors, heartbeats). port=0 on the master picks a free port.
    A client retries connecting for timeout_s, so a stage may start before the driver listens."""
    listen_fd = None
    if is_master:
        # TCPStore listens on every interface whatever host it is given: bind the socket ourselves, on host only.
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(addr)
        except OSError as e:
            sock.close()
            raise ValueError(f"cannot listen on {host}:{port} for the rendezvous ({e.strerror}); give another "
                             "--master-port, or a --master-addr of this host") from None
        sock.listen(512)
        port, listen_fd = sock.getsockname()[1], sock.detach()  # the store owns the socket now
    return dist.TCPStore(host, port, is_master=is_master, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=False, master_listen_fd=listen_fd)


_warned: set[str] = set()


class SignedStore:
    """The rendezvous store, with every value signed by the run's token (HMAC over key and value), so that a
    process that reaches the store's port without the token cannot plant a plan, a stage's arguments or a report.
    No counters (add): a tag cannot be kept on a value the store increments, and the store drops the connection
    of a client whose add meets a value that is not a number, which anyone could plant."""

    def __init__(self, store: dist.Store, key: bytes, prefix: str = ""):
        self.store, self.key, self.prefix = store, key, prefix

    def generation(self, generation: int) -> "SignedStore":
        return SignedStore(self.store, self.key, f"pipellm/{generation}/")

    @property
    def raw(self) -> dist.Store:  # the same keys, unsigned, for gloo's own rendezvous
        return dist.PrefixStore(self.prefix, self.store) if self.prefix else self.store

    def set(self, key: str, value: bytes | str) -> None:
        full = self.prefix + key
        self.store.set(full, wire.seal(self.key, full.encode(), value.encode() if isinstance(value, str) else value))

    def get(self, key: str) -> bytes:
        """The value (waiting for it as the store does), or WireError if it is not signed with this run's token."""
        full = self.prefix + key
        return bytes(wire.unseal(self.key, full.encode(), self.store.get(full), f"the store's key {full}"))

    def trusted(self, key: str) -> bytes | None:
        """The value if set and signed; a forged one is logged and ignored (None), as an absent one."""
        try:
            return self.get(key) if self.check(key) else None
        except wire.WireError as e:
            if key not in _warned:  # once per key: a poisoned key is read every poll
                _warned.add(key)
                log.warning("ignored: %s", e)
            return None

    def check(self, key: str) -> bool:
        return self.store.check([self.prefix + key])

    def wait(self, keys: list[str], timeout: timedelta) -> None:
        self.store.wait([self.prefix + k for k in keys], timeout)


# Keys of the rendezvous store. Each pipeline (a first start or a restart after a failure) is a new generation whose
# keys, process group included, live under a prefix of their own, so a restarted pipeline never reads stale ones.
GENERATION_KEY = "pipellm/generation"  # the newest generation; stages and node agents start on it
GENERATION_ENV = "PIPELLM_GENERATION"  # ... handed to the stages pipellm starts; torchrun's read the key
PARENT_PID_ENV = "PIPELLM_PARENT_PID"  # the process that started a stage: a stage whose parent is gone exits
NNODES_KEY = "pipellm/nnodes"
SHUTDOWN_KEY = "pipellm/shutdown"      # the driver is done: node agents exit


def agent_key(node_rank: int) -> str:  # a count the node agent of a host raises while it runs
    return f"pipellm/agent/{node_rank}"


def bye_key(node_rank: int) -> str:  # set by a node agent that saw the driver's shutdown
    return f"pipellm/bye/{node_rank}"


def args_key(rank: int) -> str:      # StageArgs of stage `rank`, wire-encoded
    return f"args/{rank}"


def ready_key(rank: int) -> str:     # JSON {"pid", "host"} once loaded
    return f"ready/{rank}"


def error_key(rank: int) -> str:     # JSON {"type", "message", "traceback"} of a failed stage
    return f"error/{rank}"


def exit_key(rank: int) -> str:      # return code of a stage that ended, written by its node agent
    return f"exit/{rank}"


def device_key(rank: int) -> str:    # device.identity() of the stage's device, for its neighbours' transport
    return f"device/{rank}"


def heartbeat_key(rank: int) -> str:  # a count the stage raises every HEARTBEAT_S
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


def make_channel(store: SignedStore, world_rank: int, num_stages: int, master_addr: str,
                 batches_in_flight: int) -> "Channel":
    # A process group object of our own rather than the default group: the user's process may
    # hold several engines, or a default group of its own.
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout, opts._threads = FOREVER, 2
    ifname = os.environ.get("GLOO_SOCKET_IFNAME")  # the user's choice of interface wins
    opts._devices = [dist.ProcessGroupGloo.create_device(interface=ifname) if ifname else
                     dist.ProcessGroupGloo.create_device(hostname=local_address(master_addr))]
    pg = dist.ProcessGroupGloo(store.raw, world_rank, num_stages + 1, opts)
    return Channel(pg, world_rank, max_pending_sends(world_rank, num_stages, batches_in_flight), store.key,
                   store.prefix)


def nccl_links(store: SignedStore, stage: int, num_stages: int, identity: str) -> dict[int, tuple]:
    """For each neighbouring stage whose GPU is not this stage's (device.uses_nccl): world rank -> (an NCCL group of
    the two, the neighbour's rank in it). Every stage has published its device identity (device_key) before."""
    links = {}
    for peer in (stage - 1, stage + 1):
        if 0 <= peer < num_stages and device.uses_nccl(identity, store.get(device_key(peer)).decode()):
            low = min(stage, peer)
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = FOREVER
            pg = dist.ProcessGroupNCCL(dist.PrefixStore(f"nccl/{low}/", store.raw), stage - low, 2, opts)
            links[stage_world_rank(peer)] = (pg, peer - low)
    return links


# Tags keep the three kinds of traffic apart, so a receive posted early matches only its own kind.
TAG_MESSAGE, TAG_OVERFLOW, TAG_TENSOR = 0, 1, 2
MAILBOX_BYTES = 32 * 1024  # one message of this size holds a whole decode batch
SEND_TIMEOUT = timedelta(seconds=60)  # for a send that should be done already: not answering means a dead peer


class Channel:
    """Sends tensors and messages (pipellm.pipeline.wire) to one peer at a time; sends are async, receives block.

    Messages go in fixed-size mailbox tensors whose receive is posted ahead of time. A gloo receive
    posted after the data was sent costs a round trip to the sender, and the sender's I/O thread may
    be waiting behind its own compute for a core: several ms on the critical path of every step.
    Each message is signed for its generation, its sender and receiver, and its place in their sequence, so
    one can neither be forged nor replayed.
    """

    def __init__(self, pg: dist.ProcessGroup, rank: int, max_pending: int, key: bytes, context: str):
        self.pg, self.rank, self.key, self.context = pg, rank, key, context
        self._sent: dict[int, int] = {}      # dst -> messages sent to it
        self._received: dict[int, int] = {}  # src -> messages received from it
        # (work, tensor kept alive until sent). A gloo send reports completion only once waited on, so sends are
        # waited on, oldest first, once more than max_pending are out: by then they are received, and the wait is
        # instant (see max_pending_sends). Without it, every message sent would be kept.
        self._pending: deque[tuple[object, torch.Tensor]] = deque()
        self.max_pending = max_pending
        self._posted: dict[int, tuple[object, torch.Tensor]] = {}  # src -> (work, mailbox) received into next
        self.links: dict[int, tuple] = {}  # peer -> (NCCL group, its rank there): hidden states between two GPUs

    def send_tensor(self, tensor: torch.Tensor, dst: int, tag: int = TAG_TENSOR) -> None:
        tensor = tensor.contiguous()
        self._keep(self.pg.send([tensor], dst, tag), tensor)

    def _keep(self, work, tensor: torch.Tensor) -> None:
        self._pending.append((work, tensor))
        while len(self._pending) > self.max_pending:
            self._pending.popleft()[0].wait(SEND_TIMEOUT)

    def recv_tensor(self, shape, dtype: torch.dtype, src: int, timeout: timedelta = FOREVER,
                    tag: int = TAG_TENSOR) -> torch.Tensor:
        tensor = torch.empty(shape, dtype=dtype)
        self.pg.recv([tensor], src, tag).wait(timeout)
        return tensor

    def send_hidden(self, tensor: torch.Tensor, dst: int) -> None:
        """Activations to the next stage: GPU to GPU over NCCL (on its own stream: the next compute overlaps the
        transfer), else through host memory (.cpu() is free for a CPU tensor)."""
        if dst not in self.links:
            return self.send_tensor(tensor.cpu(), dst)
        pg, peer = self.links[dst]
        tensor = tensor.contiguous()
        self._keep(pg.send([tensor], peer, TAG_TENSOR), tensor)

    def recv_hidden(self, shape, dtype: torch.dtype, src: int, device: torch.device) -> torch.Tensor:
        if src not in self.links:
            return self.recv_tensor(shape, dtype, src).to(device)
        pg, peer = self.links[src]
        tensor = torch.empty(shape, dtype=dtype, device=device)
        pg.recv([tensor], peer, TAG_TENSOR).wait()  # orders this stream after the transfer
        return tensor

    def _frame_context(self, src: int, dst: int, seq: int) -> bytes:
        return f"{self.context}{src}>{dst}#{seq}".encode()

    def send_obj(self, obj, dst: int) -> None:
        seq = self._sent.get(dst, 0)
        self._sent[dst] = seq + 1
        data = wire.seal(self.key, self._frame_context(self.rank, dst, seq), wire.encode(obj))
        # only the bytes used: a receive takes a message shorter than its mailbox (its first 8 bytes give the size)
        head = len(data).to_bytes(8, "little") + data[:MAILBOX_BYTES - 8]
        self.send_tensor(torch.frombuffer(bytearray(head), dtype=torch.uint8), dst, TAG_MESSAGE)
        if len(data) > MAILBOX_BYTES - 8:
            self.send_tensor(torch.frombuffer(bytearray(data[MAILBOX_BYTES - 8:]), dtype=torch.uint8), dst,
                             TAG_OVERFLOW)

    def post_recv(self, src: int) -> None:
        """Posts the receive of the next message from src, if not posted yet."""
        if src not in self._posted:
            mailbox = torch.empty(MAILBOX_BYTES, dtype=torch.uint8)
            self._posted[src] = (self.pg.recv([mailbox], src, TAG_MESSAGE), mailbox)

    def recv_obj(self, src: int, expected: tuple[type, ...], timeout: timedelta = FOREVER):
        """The next message from src, which must be one of the expected kinds; WireError naming src otherwise."""
        self.post_recv(src)
        work, mailbox = self._posted.pop(src)
        work.wait(timeout)
        try:
            self.post_recv(src)
        except RuntimeError:
            pass  # src has closed its end (the last message was Shutdown): raised if a next message is awaited
        raw = memoryview(mailbox.numpy())
        size = int.from_bytes(raw[:8], "little")
        if size > wire.MAX_PAYLOAD_BYTES + wire.TAG_BYTES:  # checked before anything that size is allocated
            raise wire.WireError(f"{peer_name(src)} announced a message of {size} bytes, over the limit")
        data = bytearray(raw[8:8 + size])
        if size > MAILBOX_BYTES - 8:
            data += self.recv_tensor((size - (MAILBOX_BYTES - 8),), torch.uint8, src, timeout,
                                     TAG_OVERFLOW).numpy().tobytes()
        seq = self._received.get(src, 0)
        self._received[src] = seq + 1
        payload = wire.unseal(self.key, self._frame_context(src, self.rank, seq), data, peer_name(src))
        try:
            return wire.decode(payload, expected)
        except wire.WireError as e:
            raise wire.WireError(f"a message from {peer_name(src)} is malformed: {e}") from None

    def flush(self, timeout: timedelta = FOREVER) -> None:
        for work, _ in self._pending:
            work.wait(timeout)
        self._pending.clear()
