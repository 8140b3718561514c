"""Failure detection: what ends a run rather than letting it train on without a peer."""

from __future__ import annotations

import collections
import time
from trimlab.agents.collect import Collector, Reduced
from trimlab.agents.context import NodeContext
from trimlab.errors import TrimlabError


class ProtocolError(TrimlabError):
    """A peer stopped answering or a step could not complete: the run fails."""

    exit_code = 1


class MissedSteps:
    """A rank that contributed nothing for `limit` steps in a row and has sent nothing at all
    (no late gradient, no acknowledgement) for `silence_s` has stopped: fail the run rather
    than train on without it. A rank that is merely slower than the deadline is not."""

    def __init__(self, node_ctx: NodeContext, limit: int, silence_s: float = 3.0):
        self.node_ctx, self.limit, self.silence_s = node_ctx, limit, silence_s
        self.row: collections.Counter = collections.Counter()

    def check(self, coll: Collector, reduced: Reduced) -> None:
        now = time.monotonic()
        for rank, n in reduced.per_rank.items():
            self.row[rank] = 0 if n else self.row[rank] + 1
            heard = self.node_ctx.last_heard.get(coll.ranks[rank], coll.opened)
            if self.row[rank] >= self.limit and now - heard > self.silence_s:
                raise ProtocolError(f"{self.node_ctx.name_of(coll.ranks[rank])} (rank {rank}) sent no "
                                    f"gradient packet for {self.limit} steps in a row (last: step "
                                    f"{coll.step}) and nothing at all for {now - heard:.1f} s")
