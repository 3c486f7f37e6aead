"""The process's limits.

Mirrors vllm/utils/system_utils.py (``set_ulimit``) and nothing else of it.
Departure: when the hard limit on open files is below the target, the soft
limit is raised to the hard limit (vLLM asks for the target, fails, warns and
leaves the soft limit where it was).
"""

from __future__ import annotations

import resource

from tracevllm.logger import init_logger

logger = init_logger(__name__)


def set_ulimit(target_soft_limit: int = 65535) -> None:
    """Raise the soft limit on open files towards ``target_soft_limit``.

    Every connection the server holds is a file descriptor; a soft limit of
    1024 (a common default) would stop the server from accepting at 1024
    connections, idle ones included.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = target_soft_limit if hard == resource.RLIM_INFINITY else min(target_soft_limit, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as e:
            logger.warning(
                "Found ulimit of %s and failed to automatically increase it (%s). This can "
                "cause fd limit errors like `OSError: [Errno 24] Too many open files`. "
                "Consider increasing it with ulimit -n.",
                soft,
                e,
            )
