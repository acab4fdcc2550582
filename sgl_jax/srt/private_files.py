"""Files only the server's user can read: dumps that hold other users' request ids.

An expert-distribution dump in per-token mode holds every recorded request's id and the
experts its tokens were routed to; written world-readable under a shared temporary
directory, any local user could read other users' routing. Dumps therefore default to a
directory of the user's own cache (``$XDG_CACHE_HOME/sgl_jax/...`` or
``~/.cache/sgl_jax/...``, created 0700) and every file is created 0600, wherever it goes.
"""

from __future__ import annotations

import os
import stat
from typing import IO, Any


def cache_dir(*parts: str) -> str:
    """``$XDG_CACHE_HOME/sgl_jax/<parts>`` (``~/.cache`` when the variable is unset)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "sgl_jax", *parts)


def private_dir(path: str) -> str:
    """``path`` created if missing (0700) and made 0700; refuses a path that is a symlink or
    belongs to another user (someone else could read or swap the files in it)."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise PermissionError(f"{path} is not a directory of this user (a symlink, or owned "
                              "by another user); choose another dump directory")
    if stat.S_IMODE(info.st_mode) != 0o700:
        os.chmod(path, 0o700)
    return path


def dump_dir(configured: str | None, *default_parts: str) -> str:
    """Where a dump goes: the configured directory (created if missing; its mode is the
    operator's choice), else the private default under the user's cache directory."""
    if configured:
        os.makedirs(configured, exist_ok=True)
        return configured
    return private_dir(cache_dir(*default_parts))


def create_private(path: str) -> IO[bytes]:
    """A new file at ``path``, mode 0600 from its creation (never an existing file and never
    through a symlink)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    os.fchmod(fd, 0o600)  # whatever the umask
    return os.fdopen(fd, "wb")


PATH_HIDDEN = "<hidden: a filesystem path, shown with the admin key>"


def _is_path(value: str) -> bool:
    return value.startswith(("/", "~", "./", "../")) or (
        os.sep in value and os.path.exists(value))


def without_paths(info: Any) -> Any:
    """``info`` (JSON-like) with every string that names a filesystem path replaced by
    ``PATH_HIDDEN``: what a non-admin client may see of the server's settings."""
    if isinstance(info, dict):
        return {k: without_paths(v) for k, v in info.items()}
    if isinstance(info, list | tuple):
        return [without_paths(v) for v in info]
    if isinstance(info, str) and _is_path(info):
        return PATH_HIDDEN
    return info
