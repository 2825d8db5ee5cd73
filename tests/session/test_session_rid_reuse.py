"""A request id reused after a session's first turn must not inherit that turn's lock state.

The first turn of a session is admitted by the inner tree (which remembers its rid as holding a
lock); the slot then takes the lock over. A later request under the same rid that is aborted
before its own admit used to be taken for the old one: its unlocked match node was "unlocked"
again, corrupting lock counts (and raising)."""

from __future__ import annotations

from session_helpers import Conversation, make_stack

from hicache.prefix_cache import Req


async def test_reused_rid_after_a_first_turn_aborts_cleanly() -> None:
    stack = make_stack()
    plain = Conversation(stack, "plain", seed=2, streaming=False)
    await plain.turn(n_in=12, n_out=1)  # its prompt goes into the tree
    conv = Conversation(stack, "chat", seed=1)
    conv.history = list(plain.history[:8])
    first = await conv.turn(n_in=4, n_out=3)
    assert first.prefix_len == 8  # the first turn matched (and locked) the tree
    assert not stack.inner.is_admitted(first.req)
    # a plain request reusing the first turn's rid, sharing its prefix, aborted before admit
    again = Req(rid=first.req.rid, origin_input_ids=list(plain.history[:8]) + [7, 7, 7, 7])
    stack.cache.match_req(again)
    assert again.last_node is not None and again.last_node is not stack.inner.root_node
    stack.cache.abort_req(again)  # must not release a lock it never took
    stack.inner.sanity_check()
    # and the session itself goes on and closes without a lock left behind
    await conv.turn(n_in=4, n_out=2)
    stack.cache.release_session("chat")
    await stack.cache.drain()
    assert stack.inner.protected_size() == 0
    await stack.aclose()
