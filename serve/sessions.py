"""SGLang's sessions: /open_session, /close_session and /generate's `session_params`.

A session keeps the token ids of each request made in it (its prompt and its output), so
that a later request names one of them (`session_params.rid`) and sends only what comes
next. Its prompt is then the named request's prompt and output (only the prompt with
`drop_previous_output`), cut to its first `offset` tokens when `offset` is given (a
negative one counts from the end, as a Python slice), followed by the new input, whose
first token is dropped when it is the model's BOS token. The named request must have
finished. `replace` branches instead of appending: the named request's later requests are
forgotten (and stopped when still running), the named one stopped too when running;
without a rid, `replace` empties the session and the request starts afresh. The K/V of
the shared part is found again through the prefix cache, as in SGLang; a session does not
pin it.

What is kept is bounded by --max-session-tokens (kiln's flag): each request's prompt and
output tokens, and each open session a fixed SESSION_TOKENS. When a new request would pass
the bound, the least recently used sessions with nothing running are closed first (a later
request naming one gets a 404); when even that cannot make room, the request gets a 400.
A session's id (128 random bits unless the opener names one) is what lets a caller use or
close it: anyone holding it can continue, branch or stop the session's requests, and no
one else can. Ids are never listed.
"""

from __future__ import annotations

import uuid
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from kiln.runtime.request import Request
from kiln.serve.streams import ApiError

DEFAULT_TOKENS = 4 * 1024 * 1024
SESSION_TOKENS = 64  # what an open session itself is charged, whatever it holds
MAX_ID_CHARS = 256


@dataclass(eq=False)
class Turn:
    """One request of a session. `request`: the engine's, until it has finished and its
    output is copied into `output`."""

    prompt: array[int]
    max_new_tokens: int
    parent: Turn | None
    request: Request | None = None
    output: array[int] | None = None
    children: list[str] = field(default_factory=list)

    @property
    def running(self) -> bool:
        return self.output is None

    @property
    def size(self) -> int:
        """Tokens charged: the prompt, and the output (its bound until it has one)."""
        out = self.max_new_tokens if self.output is None else len(self.output)
        return len(self.prompt) + out

    def settle(self) -> int:
        """Copy a finished request's output (at most max_new_tokens, as SGLang); the
        change in size."""
        req = self.request
        if self.output is not None or req is None or not req.finished:
            return 0
        before = self.size
        self.output = array("i", req.output_ids[: self.max_new_tokens])
        self.request = None
        return self.size - before


@dataclass(eq=False)
class Session:
    capacity_of_str_len: int  # SGLang's field: accepted and kept, not a bound (as there)
    turns: dict[str, Turn] = field(default_factory=dict)

    @property
    def running(self) -> bool:
        return any(t.running for t in self.turns.values())


class SessionStore:
    def __init__(self, budget: int = DEFAULT_TOKENS) -> None:
        self.budget = budget
        self.used = 0
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        self._running: set[Turn] = set()  # the turns whose request may not have settled

    def __len__(self) -> int:
        return len(self._sessions)

    def _settle(self) -> None:
        for turn in list(self._running):
            self.used += turn.settle()
            if not turn.running:
                self._running.discard(turn)

    def _make_room(self, tokens: int, keep: str) -> bool:
        """Close least recently used idle sessions (never `keep`) until `tokens` more fit;
        False, with none closed, when closing every one of them would not be enough."""
        self._settle()
        idle = [s for s, v in self._sessions.items() if s != keep and not v.running]
        freeable = sum(SESSION_TOKENS + self._held(self._sessions[s]) for s in idle)
        if self.used - freeable + tokens > self.budget:
            return False
        for sid in idle:
            if self.used + tokens <= self.budget:
                break
            self.close(sid)
        return True

    @staticmethod
    def _held(session: Session) -> int:
        return sum(t.size for t in session.turns.values())

    def open(self, session_id: str | None, capacity_of_str_len: int) -> str:
        if session_id is None:
            session_id = uuid.uuid4().hex
        elif not 1 <= len(session_id) <= MAX_ID_CHARS:
            raise ApiError(400, f"session_id: 1 to {MAX_ID_CHARS} characters")
        if session_id in self._sessions:
            raise ApiError(400, f"session {session_id!r} is already open")
        if not self._make_room(SESSION_TOKENS, ""):
            raise ApiError(
                400, "the open sessions' running requests hold all of --max-session-tokens"
            )
        self._sessions[session_id] = Session(capacity_of_str_len)
        self.used += SESSION_TOKENS
        return session_id

    def close(self, session_id: str) -> bool:
        """Forget the session (its running requests go on to their end); False if unknown."""
        session = self._sessions.pop(session_id, None)
        if session is None:
            return False
        self.used -= SESSION_TOKENS + self._held(session)
        self._running.difference_update(session.turns.values())
        return True

    def get(self, session_id: str) -> Session:
        session = self._sessions.get(session_id)
        if session is None:
            raise ApiError(
                404,
                f"session {session_id[:MAX_ID_CHARS]!r} is not open (never opened, closed, "
                "or closed under --max-session-tokens)",
                "NotFoundError",
            )
        self._sessions.move_to_end(session_id)
        return session

    def _forget(self, session: Session, rid: str, stop: list[Request]) -> None:
        """Drop turn `rid` and its later turns, collecting the running ones' requests."""
        turn = session.turns.pop(rid)
        self.used -= turn.size
        self._running.discard(turn)
        for child in turn.children:
            if child in session.turns:
                self._forget(session, child, stop)
        if turn.running and turn.request is not None:
            stop.append(turn.request)

    def begin(
        self,
        session_id: str,
        params: dict[str, Any],
        rid: str,
        new_ids: list[int],
        max_new_tokens: int,
        bos: int | None,
    ) -> tuple[list[int], list[Request]]:
        """Record request `rid` in the session and build its prompt from `session_params`
        (SGLang's fields: rid, offset, replace, drop_previous_output); the prompt, and the
        running requests `replace` forgot, which the caller stops. Raises ApiError(400 or
        404) naming the problem, with nothing changed."""
        session = self.get(session_id)
        if rid in session.turns:
            raise ApiError(400, f"rid {rid!r} is already a request of session {session_id!r}")
        self._settle()
        parent_rid = params.get("rid")
        replace = bool(params.get("replace"))
        parent = None
        if parent_rid is not None:
            parent = session.turns.get(parent_rid)
            if parent is None:
                raise ApiError(
                    400, f"session_params.rid {parent_rid!r} is not a request of this session"
                )
            if parent.running and not replace:
                raise ApiError(
                    400,
                    f"session_params.rid {parent_rid!r} has not finished; continue it once it "
                    "has, or replace it",
                )
        if parent is not None and new_ids and bos is not None and new_ids[0] == bos:
            new_ids = new_ids[1:]  # an appended turn does not start the text again
        prompt = self._prompt(parent, params, new_ids)
        if not prompt:
            raise ApiError(400, "the prompt is empty")
        stop: list[Request] = []
        if replace:
            # SGLang: the named request is stopped, not forgotten (its tokens so far stay
            # the base of this one); without one, the session is emptied.
            if parent is None:
                for t in list(session.turns):
                    if t in session.turns:
                        self._forget(session, t, stop)
            else:
                for child in parent.children:
                    if child in session.turns:
                        self._forget(session, child, stop)
                parent.children = []
                if parent.running and parent.request is not None:
                    stop.append(parent.request)
        size = len(prompt) + max_new_tokens
        if not self._make_room(size, session_id):
            raise ApiError(
                400,
                f"this session request ({size} tokens with its max_new_tokens) does not fit "
                f"in --max-session-tokens ({self.budget}) beside the running ones",
            )
        turn = Turn(array("i", prompt), max_new_tokens, parent)
        session.turns[rid] = turn
        self._running.add(turn)
        self.used += turn.size
        if parent is not None:
            parent.children.append(rid)
        return prompt, stop

    @staticmethod
    def _prompt(parent: Turn | None, params: dict[str, Any], new_ids: list[int]) -> list[int]:
        if parent is None:
            return list(new_ids)
        base = list(parent.prompt)
        if not params.get("drop_previous_output"):
            req = parent.request  # a replaced request still running: its tokens so far
            out = parent.output if parent.output is not None else (req.output_ids if req else [])
            base += list(out[: parent.max_new_tokens])
        offset = params.get("offset")
        if offset:
            base = base[:offset]
        return base + list(new_ids)

    def attach(self, session_id: str, rid: str, request: Request) -> bool:
        """Give turn `rid` its engine request; False when the turn was forgotten meanwhile
        (a replace or close while it was being built): the caller stops the request."""
        session = self._sessions.get(session_id)
        turn = session.turns.get(rid) if session is not None else None
        if turn is None:
            return False
        self.used -= turn.size
        # the request's own prompt: --allow-auto-truncate may have cut the one built here
        turn.prompt = array("i", request.prompt_ids)
        turn.request, turn.max_new_tokens = request, request.params.max_new_tokens
        self.used += turn.size
        return True

    def discard(self, session_id: str, rid: str) -> None:
        """Forget turn `rid` whose request was never made (its build failed)."""
        session = self._sessions.get(session_id)
        if session is None or rid not in session.turns:
            return
        turn = session.turns.pop(rid)
        self.used -= turn.size
        self._running.discard(turn)
        if turn.parent is not None and rid in turn.parent.children:
            turn.parent.children.remove(rid)
