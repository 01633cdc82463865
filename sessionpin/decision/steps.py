"""What the request path's stepper (``route``) is given, asks for and is told: plain data.

``Request`` is what the shell read from the flow; an effect is what the stepper asks the
shell to do (or, terminal, how to answer the flow); an event is what the shell saw when it
did it. route.py's docstring pairs each effect with its events.

Each is a frozen msgspec struct, as ``route.State`` is: a request makes a dozen of them, and a
struct is built in a tenth of a frozen dataclass's time (issue 22).
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Mapping

import msgspec

from ..reader import facts as F
from ..config.config import Config, Server
from ..lineage.lineage import Signals
from ..records.pins import Loaded, Pin
from .rewrite import Changes

TITLE_TTL = 3600.0      # how long an opencode title-shaped request is remembered


class Request(msgspec.Struct, frozen=True):
    """What the shell read from the flow: plain data."""
    facts: F.Facts
    source: Server | None        # the configured server it addresses (None: none)
    config: Config
    now: float                   # epoch seconds
    nonce: str = ""              # random, from the shell: a new fingerprint conversation's id
    scheme: str = "https"        # where the flow was sent: a rewrite to another origin is checked reachable
    host: str = ""
    port: int = 0
    path: str = ""               # path and query, as sent
    upgrade: bool = False        # a WebSocket upgrade (no body: its messages' models are renamed as they pass)
    unnamed: str = ""            # a path sessionpin does not route, ending with this endpoint: only guarded
    env: Mapping[str, str] = MappingProxyType({})   # where the servers' keys are (never shown: ``__repr__``)

    def __rich_repr__(self):
        for name in self.__struct_fields__:
            if name != "env":
                yield name, getattr(self, name)

    def __repr__(self) -> str:
        return f"Request({', '.join(f'{n}={v!r}' for n, v in self.__rich_repr__())})"


# ---- effects ----------------------------------------------------------------------------

class ReadPin(msgspec.Struct, frozen=True):
    session: str


class ReadTitle(msgspec.Struct, frozen=True):
    session: str


class ReadLineage(msgspec.Struct, frozen=True):
    pass


class FindConversation(msgspec.Struct, frozen=True):
    agent: str
    root: str | None
    fingerprint: str


class FindParent(msgspec.Struct, frozen=True):
    agent: str
    session: str                 # the request's own (never its own parent)
    sessions: tuple[str, ...]    # parent ids the client named
    anchors: tuple[str, ...]     # earlier responses it named ("req:…", "msg:…", "resp:…")
    root: str | None             # its history's root key


class Plan(msgspec.Struct, frozen=True):
    target: str
    body: bool = False           # the decoded body is needed (the target renames the model)


class CreatePin(msgspec.Struct, frozen=True):
    session: str
    pin: Pin
    seen: Loaded                 # what was read (a garbage value is replaced by compare-and-set)


class CheckReachable(msgspec.Struct, frozen=True):
    """Before a request leaves for another origin than it addressed: can ``target`` be reached?"""
    target: str
    host: str
    port: int


class Forward(msgspec.Struct, frozen=True):
    changes: Changes


class Leave(msgspec.Struct, frozen=True):
    pass


class Refuse(msgspec.Struct, frozen=True):
    status: int
    kind: str                    # short reason id (metrics, x-sessionpin-refused)
    message: str                 # for the agent's user: what happened and what to do
    retry_after: int | None = None   # seconds; None: retrying will not help
    api: str | None = None           # the error format, when not the request's own (an ambiguous path)
    changes: Changes | None = None   # the plan it stopped, shown with the decision (an unreachable server)


# ``after`` effects
class RenewPin(msgspec.Struct, frozen=True):
    session: str
    seen: Loaded


class RememberTitle(msgspec.Struct, frozen=True):
    session: str
    server: str
    ttl: float = TITLE_TTL


class RememberOpening(msgspec.Struct, frozen=True):
    """A fingerprint conversation began: the latest with this opening (``lineindex``)."""
    agent: str
    fingerprint: str
    session: str


class WritePin(msgspec.Struct, frozen=True):
    """A pin that does not move the request ("not routed"): written after it left."""
    session: str
    pin: Pin
    seen: Loaded


class Allocate(msgspec.Struct, frozen=True):
    """Choose a member of ``pool`` and pin the session there in one transaction."""
    session: str
    pool: str
    pin: Pin                     # the pin to write; the allocation fills in the member
    seen: Loaded                 # what was read (a soft move: the pin it replaces)
    commit: bool = True          # False: only choose (a side request pins nothing)
    exclude: frozenset[str] = frozenset()   # members this request missed (soft)
    reason: str = ""             # a soft move: why the pinned member was missed


class CheckMember(msgspec.Struct, frozen=True):
    """Before a request goes to a pool member: known exhausted? In a soft pool, missing?"""
    pool: str
    member: str
    soft: bool


Effect = (ReadPin | ReadTitle | ReadLineage | FindConversation | FindParent | Plan | CreatePin | Allocate
          | CheckMember | CheckReachable | Forward | Leave | Refuse)
After = RenewPin | RememberTitle | WritePin | RememberOpening
TERMINAL = (Forward, Leave, Refuse)


# ---- events -----------------------------------------------------------------------------

class PinRead(msgspec.Struct, frozen=True):
    loaded: Loaded


class TitleRead(msgspec.Struct, frozen=True):
    server: str | None


class LineageRead(msgspec.Struct, frozen=True):
    signals: Signals
    root: str | None             # the key after the history's first model turn, if it has one


class ConversationFound(msgspec.Struct, frozen=True):
    session: str | None
    # conversations that began with the same opening, pinned to different places (session,
    # server): the turn could be any of them (``lineindex.Found.apart``); then no session
    apart: tuple[tuple[str, str | None], ...] = ()


class ParentFound(msgspec.Struct, frozen=True):
    session: str | None          # None: no parent known
    loaded: Loaded = Loaded(None, None)


class StoreFailed(msgspec.Struct, frozen=True):
    error: str                   # names the store and the cause


class StoreLost(msgspec.Struct, frozen=True):
    error: str                   # names the store, what it lost and the command that decides


class Planned(msgspec.Struct, frozen=True):
    changes: Changes


class PinCreated(msgspec.Struct, frozen=True):
    pass


class PinLost(msgspec.Struct, frozen=True):
    loaded: Loaded               # the pin another proxy wrote first


class NotSaved(msgspec.Struct, frozen=True):
    error: str


class Allocated(msgspec.Struct, frozen=True):
    member: str
    loaded: Loaded               # the pin the allocation wrote (pin None: not committed)
    why: str                     # "pool glm: round-robin → glm-b", "soft: glm-a unreachable → glm-b"


class NotAllocated(msgspec.Struct, frozen=True):
    status: int                  # 429 pool exhausted, 503 contention or no member
    kind: str
    message: str
    retry_after: int | None


class MemberChecked(msgspec.Struct, frozen=True):
    exhausted_until: float = 0.0     # epoch seconds; past: not exhausted
    exhausted_why: str = ""
    missing: str | None = None       # soft pools: why it cannot take requests ("drained", "unreachable")


class Reachable(msgspec.Struct, frozen=True):
    error: str | None = None         # None: reachable; else why not (ConnectCheck's words)


Event = (PinRead | TitleRead | LineageRead | ConversationFound | ParentFound | StoreFailed | StoreLost | Planned
         | PinCreated | PinLost | NotSaved | Allocated | NotAllocated | MemberChecked | Reachable)
