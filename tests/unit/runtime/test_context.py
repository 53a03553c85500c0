"""Context: stop/kill, awaitables, parent -> child propagation, callbacks."""

from __future__ import annotations

import asyncio

from dynamo.runtime.context import Context


async def test_stop_and_kill() -> None:
    ctx = Context("r1")
    assert ctx.id == "r1" and not ctx.is_stopped() and not ctx.is_killed()
    waiter = asyncio.create_task(ctx.stopped())
    await asyncio.sleep(0)
    ctx.stop_generating()
    await asyncio.wait_for(waiter, 1)
    assert ctx.is_stopped() and not ctx.is_killed()
    ctx.kill()
    await asyncio.wait_for(ctx.killed(), 1)
    assert ctx.is_killed()


async def test_kill_implies_stop_and_children_follow() -> None:
    parent = Context()
    child = parent.child("c")
    grandchild = child.child()
    parent.kill()
    assert child.is_killed() and grandchild.is_stopped()
    late = parent.child()
    assert late.is_killed(), "a child of a killed context starts killed"


async def test_on_stop_callbacks() -> None:
    ctx = Context()
    seen: list[str] = []
    remove = ctx.on_stop(lambda c: seen.append("a"))
    ctx.on_stop(lambda c: seen.append("b"))
    remove()
    ctx.stop_generating()
    ctx.stop_generating()  # idempotent
    assert seen == ["b"]
    ctx.on_stop(lambda c: seen.append("late"))  # already stopped: runs at once
    assert seen == ["b", "late"]


async def test_detach() -> None:
    parent = Context()
    child = parent.child()
    child.detach()
    parent.stop_generating()
    assert not child.is_stopped()
