"""What the request path's stepper (``route``) is given, asks for and is told: plain data.

``Request`` is what the shell read from the flow; an effect is what the stepper asks the
shell to do (or, terminal, how to answer the flow); an event is what the shell saw when it
did it. route.py's docstring pairs each effect with its events.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

from ..reader import facts as F
from ..config.config import Config, Server
from ..lineage.lineage import Signals
from ..records.pins import Loaded, Pin
from .rewrite import Changes

TITLE_TTL = 3600.0      # how long an opencode title-shaped request is remembered


@dataclass(frozen=True)
class Request:
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
    env: Mapping[str, str] = field(default=MappingProxyType({}), repr=False)   # where the servers' keys are


# ---- effects ----------------------------------------------------------------------------

@dataclass(frozen=True)
class ReadPin:
    session: str


@dataclass(frozen=True)
class ReadTitle:
    session: str


@dataclass(frozen=True)
class ReadLineage:
    pass


@dataclass(frozen=True)
class FindConversation:
    agent: str
    root: str | None
    fingerprint: str


@dataclass(frozen=True)
class FindParent:
    agent: str
    session: str                 # the request's own (never its own parent)
    sessions: tuple[str, ...]    # parent ids the client named
    anchors: tuple[str, ...]     # earlier responses it named ("req:…", "msg:…", "resp:…")
    root: str | None             # its history's root key


@dataclass(frozen=True)
class Plan:
    target: str
    body: bool = False           # the decoded body is needed (the target renames the model)


@dataclass(frozen=True)
class CreatePin:
    session: str
    pin: Pin
    seen: Loaded                 # what was read (a garbage value is replaced by compare-and-set)


@dataclass(frozen=True)
class CheckReachable:
    """Before a request leaves for another origin than it addressed: can ``target`` be reached?"""
    target: str
    host: str
    port: int


@dataclass(frozen=True)
class Forward:
    changes: Changes


@dataclass(frozen=True)
class Leave:
    pass


@dataclass(frozen=True)
class Refuse:
    status: int
    kind: str                    # short reason id (metrics, x-sessionpin-refused)
    message: str                 # for the agent's user: what happened and what to do
    retry_after: int | None = None   # seconds; None: retrying will not help
    api: str | None = None           # the error format, when not the request's own (an ambiguous path)
    changes: Changes | None = None   # the plan it stopped, shown with the decision (an unreachable server)


# ``after`` effects
@dataclass(frozen=True)
class RenewPin:
    session: str
    seen: Loaded


@dataclass(frozen=True)
class RememberTitle:
    session: str
    server: str
    ttl: float = TITLE_TTL


@dataclass(frozen=True)
class RememberOpening:
    """A fingerprint conversation began: the latest with this opening (``lineindex``)."""
    agent: str
    fingerprint: str
    session: str


@dataclass(frozen=True)
class WritePin:
    """A pin that does not move the request ("not routed"): written after it left."""
    session: str
    pin: Pin
    seen: Loaded


@dataclass(frozen=True)
class Allocate:
    """Choose a member of ``pool`` and pin the session there in one transaction."""
    session: str
    pool: str
    pin: Pin                     # the pin to write; the allocation fills in the member
    seen: Loaded                 # what was read (a soft move: the pin it replaces)
    commit: bool = True          # False: only choose (a side request pins nothing)
    exclude: frozenset[str] = frozenset()   # members this request missed (soft)
    reason: str = ""             # a soft move: why the pinned member was missed


@dataclass(frozen=True)
class CheckMember:
    """Before a request goes to a pool member: known exhausted? In a soft pool, missing?"""
    pool: str
    member: str
    soft: bool


Effect = (ReadPin | ReadTitle | ReadLineage | FindConversation | FindParent | Plan | CreatePin | Allocate
          | CheckMember | CheckReachable | Forward | Leave | Refuse)
After = RenewPin | RememberTitle | WritePin | RememberOpening
TERMINAL = (Forward, Leave, Refuse)


# ---- events -----------------------------------------------------------------------------

@dataclass(frozen=True)
class PinRead:
    loaded: Loaded


@dataclass(frozen=True)
class TitleRead:
    server: str | None


@dataclass(frozen=True)
class LineageRead:
    signals: Signals
    root: str | None             # the key after the history's first model turn, if it has one


@dataclass(frozen=True)
class ConversationFound:
    session: str | None


@dataclass(frozen=True)
class ParentFound:
    session: str | None          # None: no parent known
    loaded: Loaded = Loaded(None, None)


@dataclass(frozen=True)
class StoreFailed:
    error: str                   # names the store and the cause


@dataclass(frozen=True)
class StoreLost:
    error: str                   # names the store, what it lost and the command that decides


@dataclass(frozen=True)
class Planned:
    changes: Changes


@dataclass(frozen=True)
class PinCreated:
    pass


@dataclass(frozen=True)
class PinLost:
    loaded: Loaded               # the pin another proxy wrote first


@dataclass(frozen=True)
class NotSaved:
    error: str


@dataclass(frozen=True)
class Allocated:
    member: str
    loaded: Loaded               # the pin the allocation wrote (pin None: not committed)
    why: str                     # "pool glm: round-robin → glm-b", "soft: glm-a unreachable → glm-b"


@dataclass(frozen=True)
class NotAllocated:
    status: int                  # 429 pool exhausted, 503 contention or no member
    kind: str
    message: str
    retry_after: int | None


@dataclass(frozen=True)
class MemberChecked:
    exhausted_until: float = 0.0     # epoch seconds; past: not exhausted
    exhausted_why: str = ""
    missing: str | None = None       # soft pools: why it cannot take requests ("drained", "unreachable")


@dataclass(frozen=True)
class Reachable:
    error: str | None = None         # None: reachable; else why not (ConnectCheck's words)


Event = (PinRead | TitleRead | LineageRead | ConversationFound | ParentFound | StoreFailed | StoreLost | Planned
         | PinCreated | PinLost | NotSaved | Allocated | NotAllocated | MemberChecked | Reachable)
