"""Custom losses that run on the server (the SDK's `ServiceClient.create_custom_loss` where the client config's
`custom_loss_server_side` is on): `create_custom_loss` rebuilds the traced loss from aspen's allowed operations
(actors/engine/custom_loss.py) and keeps it with its session under a `loss_id`; a `forward_backward` with
`loss_fn="custom"` and that `loss_id` runs it on every datum inside the fused step (one pass, where the SDK's
client-side way takes a forward, a round trip and a forward-backward). A loss belongs to the session that made
it and ends with the server (a client of a restarted server makes it again)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Depends, HTTPException
from tinker import types

from actors.engine.custom_loss import CustomLoss, CustomLossError

if TYPE_CHECKING:
    from orchestrator.tinker.wire import ForwardBackwardBody

MAX_SESSION_LOSSES = 64


def add_custom_loss_routes(router: APIRouter, ctx: Any, user_of: Callable[..., str]) -> None:
    """POST /create_custom_loss."""

    @router.post("/create_custom_loss")
    def create_custom_loss(body: types.CreateCustomLossRequest, user: str = Depends(user_of)) -> dict:
        session = ctx.session(body.session_id, user)
        if len(session.losses) >= MAX_SESSION_LOSSES:
            raise HTTPException(400, f"session {session.session_id} has made {MAX_SESSION_LOSSES} custom losses, "
                                     "the most a session keeps: reuse their handles")
        try:
            loss = CustomLoss.of(body.name, [(given.name, given.rank) for given in body.inputs],
                                 [node.model_dump(mode="json") for node in body.graph.nodes])
        except CustomLossError as error:
            raise HTTPException(400, str(error)) from None
        loss_id = f"{session.session_id}:loss:{body.custom_loss_seq_id}"
        session.losses[loss_id] = loss
        made: Future = Future()
        made.set_result(loss_id)
        return ctx.future(made, user,
                          lambda made: types.CreateCustomLossResponse(loss_id=made).model_dump(mode="json"))


def with_custom_loss(ctx: Any, message: ForwardBackwardBody, user: str) -> ForwardBackwardBody:
    """The call with its custom loss where it names one (`loss_id`): HTTPException 400 for a loss that is not of
    the model's session, 413 for a call whose datums would run too many of its operations."""
    if message.loss_id is None:
        return message
    session_id = message.model_id.split(":train:")[0]
    try:
        loss = ctx.sessions.find(session_id, user).losses[message.loss_id]
    except KeyError:
        raise HTTPException(400, f"no custom loss {message.loss_id} in session {session_id}, the model's: a loss "
                                 "runs in the session that made it, and a restarted server has none (make it "
                                 "again with create_custom_loss)") from None
    try:
        loss.check_call_size(len(message.call.datums))
    except CustomLossError as error:
        raise HTTPException(413, str(error)) from None
    return replace(message, call=replace(message.call, custom=loss))
