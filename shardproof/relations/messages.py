"""Point-to-point messages (`send`/`recv`, `isend`/`irecv`, `batch_isend_irecv`) between traced ranks.

Each rank is traced alone under the fake process group, so a `recv` there sees nothing of what was
sent: the IR records a `send` (the tensor, its destination, tag and group) and a `recv` (its
source, tag, group and buffer shape) and leaves the pairing to symbolic execution. A *channel* is
(group, source, destination, tag); messages on a channel are not overtaken (MPI's rule, which
NCCL and gloo keep), so the k-th `recv` of a channel receives the k-th `send` of that channel, and
its value is the sent tensor's term, exactly: a recv is a copy of the sender's tensor.

That pairing depends only on each rank's own program order, not on how ranks interleave, so the
executor may schedule freely. A rank that reaches a `recv` whose message is not there yet waits;
meanwhile the sends it issues later, up to its next collective, are posted ahead in their program
order as long as they read only values computed before the `recv` (a `batch_isend_irecv` listing
its `irecv` before its `isend`, or an `irecv` issued before an `isend`, runs the ring it means).
Assumed: the program does not deadlock (a blocking `send` before a blocking `recv` on both sides
may hang with some backends; the values would be the ones proven).

A discrepancy of its own kind (`unmatched message`), found without numbers, at the send or recv to
change: a `recv` whose channel no rank ever sends on (the real program hangs there), a message
received into a buffer of another shape or dtype, a message never received, a peer that is no rank
of the group. The user's program does not run as written: they want the line, not a refusal.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Sequence

from shardproof.ir.graph import Graph, Node
from shardproof.ir.ops import OPS, waits_for_peers
from shardproof.relations.mismatch import CollectiveMismatch

Channel = tuple[tuple[int, ...], int, int, int]  # (group, source, destination, tag), ranks global


class UnmatchedMessage(CollectiveMismatch):
    """A send and a recv that do not pair up: a real run hangs or reads the wrong bytes."""

    kind = "unmatched message"
    fix = "pair every recv with a send of the same shape and dtype, in the same order, between ranks of the group"


@dataclass(frozen=True)
class _Message:
    term: int
    sender: int
    node: Node


@dataclass
class Mailbox:
    """Messages sent and not yet received, per channel in send order; sends posted ahead of a
    waiting recv, per rank (see the module docstring)."""

    queues: dict[Channel, deque[_Message]] = field(default_factory=lambda: defaultdict(deque))
    ahead: dict[int, set[int]] = field(default_factory=lambda: defaultdict(set))

    def progress(self, ranks: Sequence[Graph], terms: list, cursors: list[int], waiting: list[int]) -> bool:
        """Move each rank of `waiting` that stands at a send or recv past as many as its messages
        allow; whether any rank moved."""
        moved = False
        for r in waiting:
            graph = ranks[r]
            while cursors[r] < len(graph.nodes) and OPS[(node := graph.nodes[cursors[r]]).op].kind == "p2p":
                _check_peer(r, node)
                if node.op == "send":
                    term = terms[r][node.inputs[0]]
                    if node.id in self.ahead[r]:
                        self.ahead[r].discard(node.id)
                    else:
                        self._post(r, node, term)
                else:
                    message = self._take(r, node)
                    if message is None:
                        moved |= self._post_ahead(r, graph, terms[r], cursors[r])
                        break
                    term = message.term
                terms[r].append(term)
                cursors[r] += 1
                moved = True
        return moved

    def waiting_recv(self, ranks: Sequence[Graph], cursors: list[int], pending: list[int]) -> UnmatchedMessage | None:
        """Why no rank can move when one waits at a recv: what its source does instead."""
        for r in pending:
            node = ranks[r].nodes[cursors[r]]
            if node.op == "recv":
                source = node.attrs[0]
                there = ranks[source].nodes[cursors[source]] if cursors[source] < len(ranks[source].nodes) else None
                doing = "has finished" if there is None else f"waits at {_describe(there)}"
                return UnmatchedMessage(
                    f"rank {r} waits to receive a tensor of shape {tuple(node.shape)} from rank {source} (tag "
                    f"{node.attrs[1]}) at {_site(node)}, but rank {source} sends it nothing more on that channel and "
                    f"{doing}: a real run hangs there", [(r, node)] + ([(source, there)] if there is not None else []))
        return None

    def check_delivered(self) -> None:
        """Every message sent was received (a send nobody receives hangs a real run, or is lost)."""
        for (_, source, destination, tag), queue in self.queues.items():
            if queue:
                message = queue[0]
                raise UnmatchedMessage(
                    f"rank {source} sends a tensor of shape {tuple(message.node.shape)} to rank {destination} (tag {tag}) "
                    f"at {_site(message.node)} that rank {destination} never receives: a real run hangs or loses it",
                    [(source, message.node)])

    def _post(self, rank: int, node: Node, term: int) -> None:
        self.queues[_channel(node, rank, sending=True)].append(_Message(term, rank, node))

    def _take(self, rank: int, node: Node) -> _Message | None:
        queue = self.queues[_channel(node, rank, sending=False)]
        if not queue:
            return None
        message = queue.popleft()
        sent = message.node
        if sent.shape != node.shape or sent.dtype != node.dtype:
            raise UnmatchedMessage(
                f"rank {rank} receives into a {node.dtype} tensor of shape {tuple(node.shape)} at {_site(node)} what rank "
                f"{message.sender} sends as a {sent.dtype} tensor of shape {tuple(sent.shape)} at {_site(sent)}: "
                "the k-th recv of a channel receives its k-th send; a real run fails or reads the wrong bytes",
                [(rank, node), (message.sender, sent)])
        return message

    def _post_ahead(self, rank: int, graph: Graph, terms: Sequence[int], cursor: int) -> bool:
        """Post the rank's later sends up to its next collective or call, in order, while they read
        only values computed before the recv it waits at."""
        posted = False
        for node in graph.nodes[cursor + 1 :]:
            if node.op == "call" or (waits_for_peers(node.op) and OPS[node.op].kind != "p2p"):
                break
            if node.op != "send" or node.id in self.ahead[rank]:
                continue
            if node.inputs[0] >= cursor:
                break
            self._post(rank, node, terms[node.inputs[0]])
            self.ahead[rank].add(node.id)
            posted = True
        return posted


def _check_peer(rank: int, node: Node) -> None:
    """A message to or from a rank its group does not have (the next stage after the last): a real
    run fails or hangs there."""
    peer, _, group = node.attrs
    if isinstance(peer, tuple):  # ("no rank", the group rank asked for): see ir/from_fx.py
        direction = "to" if node.op == "send" else "from"
        raise UnmatchedMessage(
            f"rank {rank} {'sends a' if node.op == 'send' else 'receives a'} tensor of shape {tuple(node.shape)} "
            f"{direction} rank {peer[1]} at {_site(node)}, but its group {list(group)} has no rank {peer[1]} "
            f"(group ranks 0 to {len(group) - 1}): a real run fails or hangs there", [(rank, node)])


def _channel(node: Node, rank: int, sending: bool) -> Channel:
    peer, tag, group = node.attrs
    return (tuple(group), rank, peer, tag) if sending else (tuple(group), peer, rank, tag)


def _site(node: Node) -> str:
    return f"{node.loc.short()} `{node.loc.code.strip()}`" if node.loc is not None else f"node `{node.name}`"


def _describe(node: Node) -> str:
    if node.op == "call":
        return f"a call of module {node.attrs[2]}"
    if OPS[node.op].kind == "p2p":
        return f"a {node.op} {'to' if node.op == 'send' else 'from'} rank {node.attrs[0]} ({_site(node)})"
    return f"{node.op} over ranks {list(node.attrs[-1])} ({_site(node)})"
