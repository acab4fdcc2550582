"""Who may talk on the step channel: the nodes of one job, which share a secret.

Every node of a multi-node job is given the same secret, from the environment variable
``SGL_JAX_NODE_SECRET`` or a file named by ``--node-secret-file`` (never as a flag value: a
command line is visible to every user of the host in ``ps``). It is read when a node starts,
kept in memory only, and never logged, shown by ``/get_server_info`` or put in the start-up
fingerprint (``ServerArgs`` holds the file's path, not its contents).

Every message of the channel carries an HMAC-SHA256 tag over a label saying what it is, the
job's nonce (32 random bytes rank 0 chooses at each start and sends in its challenge) and
the message's bytes, which hold its sequence number. So a message verifies only from a holder
of the secret, in this job (not a recording of another), as that kind of message; numbered
steps are applied only in order, so a replayed one is refused. The tag is checked before a
byte of the message is decoded.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import stat

logger = logging.getLogger(__name__)

SECRET_ENV = "SGL_JAX_NODE_SECRET"
MIN_SECRET_BYTES = 16
TAG_BYTES = 32  # HMAC-SHA256
NONCE_BYTES = 32

# Message labels: none is a prefix of another (each ends in NUL), so label + nonce + body
# never reads the same for two kinds of message.
HELLO = b"hello\0"  # follower -> rank 0: rank, fingerprint, the follower's own nonce
WELCOME = b"welcome\0"  # rank 0 -> follower: the answer to a hello
STEP = b"step\0"  # rank 0 -> followers: a numbered message


def how_to_give() -> str:
    return (f"export {SECRET_ENV}=<the same random string on every node> (e.g. from "
            f"'openssl rand -hex 32'), or pass --node-secret-file PATH (a file readable only by "
            "the server's user)")


def load_node_secret(secret_file: str | None) -> bytes:
    """The job's secret, from ``--node-secret-file`` or ``SGL_JAX_NODE_SECRET``; a ValueError
    that says how to give it when it is missing, too short, or given both ways."""
    from_env = os.environ.get(SECRET_ENV, "")
    if secret_file and from_env:
        raise ValueError(f"the node secret is given twice ({SECRET_ENV} and "
                         "--node-secret-file): give it one way")
    if secret_file:
        try:
            mode = os.stat(secret_file).st_mode
            with open(secret_file, "rb") as f:
                secret = f.read().strip()
        except OSError as e:
            raise ValueError(f"cannot read --node-secret-file {secret_file}: "
                             f"{e.strerror or e}") from e
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            logger.warning("--node-secret-file %s can be read by other users (mode %o): "
                           "chmod 600 it", secret_file, stat.S_IMODE(mode))
        where = f"--node-secret-file {secret_file}"
    elif from_env:
        secret, where = from_env.encode(), SECRET_ENV
    else:
        raise ValueError("a multi-node job (--nnodes > 1) needs a secret shared by its nodes, "
                         "so that only they can join and send steps: " + how_to_give())
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"the node secret from {where} has {len(secret)} bytes; use at least "
                         f"{MIN_SECRET_BYTES} random ones: " + how_to_give())
    return secret


def tag(secret: bytes, label: bytes, nonce: bytes, body: bytes | memoryview) -> bytes:
    mac = hmac.new(secret, label, hashlib.sha256)
    mac.update(nonce)
    mac.update(body)
    return mac.digest()


def seal(secret: bytes, label: bytes, nonce: bytes, body: bytes) -> bytes:
    """``body`` with its tag in front."""
    return tag(secret, label, nonce, body) + body


def open_sealed(secret: bytes, label: bytes, nonce: bytes,
                message: bytes | memoryview) -> memoryview:
    """The body of a ``seal``-ed message (a view, not a copy: weight updates are large);
    ValueError if its tag does not verify (the body is not looked at before)."""
    if len(message) < TAG_BYTES:
        raise ValueError(f"message of {len(message)} bytes is shorter than its tag")
    view = memoryview(message)
    got, body = view[:TAG_BYTES], view[TAG_BYTES:]
    if not hmac.compare_digest(got, tag(secret, label, nonce, body)):
        raise ValueError("message does not verify: not from a node of this job with its secret "
                         "(or altered on the way)")
    return body
