"""What the Redis store asks a server about itself, beyond its data: its replicas.

Rules it keeps:
- Only reads: ``INFO replication`` of the primary that holds the store's slot (the one
  every write goes to, and the one ``WAIT`` counts replicas of). Nothing is changed.
- "Replicas" counts those the primary calls ``online`` (their first sync done); one
  still syncing cannot acknowledge a write yet.
- A ``CONFIG``/``INFO`` refused by the server (managed Redis renames or disables them)
  is told apart from an unreachable one (``is_refusal``): the first means "nobody can
  tell", the second "not now".
"""

from __future__ import annotations

from typing import Any

from redis.exceptions import RedisError


def glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def is_refusal(e: RedisError) -> bool:
    """CONFIG GET (or INFO) refused (disabled, renamed, no permission) rather than Redis unreachable."""
    text = str(e).lower()
    return any(w in text for w in ("unknown command", "noperm", "no permissions", "not allowed", "disabled"))


async def replication(client: Any, cluster: bool, slot_key: str) -> dict[str, Any]:
    """``{"role": "master"|"slave", "replicas": n online}`` of the node that owns ``slot_key``."""
    if cluster:
        await client.initialize()
        node = client.get_node_from_key(slot_key)
        info = await client.info("replication", target_nodes=node)
    else:
        info = await client.info("replication")
    online = [v for k, v in info.items()
              if k.startswith("slave") and isinstance(v, dict) and v.get("state") == "online"]
    return {"role": str(info.get("role", "?")), "replicas": len(online)}
