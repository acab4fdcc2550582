"""Messages between processes: a pickled io_struct dataclass, its large arrays out of band.

``send_obj`` pickles with protocol 5 and hands every contiguous numpy array (routed-experts
rows) to ZMQ as its own frame of raw bytes, without a copy into the pickle; ``recv_obj``
rebuilds the object with arrays that are read-only views of the received frames. So rows are
never serialized into a pickle stream, never base64-encoded between processes, and never copied
by the transport beyond what ZMQ itself does.

Both ends of a socket must use these two functions (they replace ``send_pyobj`` /
``recv_pyobj`` on the scheduler -> detokenizer -> tokenizer manager sockets).
"""

from __future__ import annotations

import pickle
from typing import Any

import zmq


def send_obj(socket: zmq.Socket, obj: Any, flags: int = 0) -> None:
    buffers: list[pickle.PickleBuffer] = []
    head = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    if not buffers:
        socket.send(head, flags)
        return
    # Zero-copy: ZMQ keeps the buffers alive until sent (pyzmq still copies small frames).
    socket.send_multipart([head, *(b.raw() for b in buffers)], flags, copy=False)


def recv_obj(socket: zmq.Socket, flags: int = 0) -> Any:
    frames = socket.recv_multipart(flags, copy=False)
    return pickle.loads(frames[0].buffer, buffers=[f.buffer for f in frames[1:]])
