import socket
import subprocess
import sys

import pytest
from leftovers import Snapshot, assert_none_left


def test_a_child_and_a_listening_port_are_seen_until_they_go():
    before = Snapshot.take()
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    left = Snapshot.take().new_since(before)
    assert left["processes"] == [child.pid]
    assert left["ports"] == [port]
    with pytest.raises(AssertionError, match="left over"):
        assert_none_left(before, grace_s=0.0)
    child.stdin.close()
    child.wait(timeout=10)
    server.close()
    assert_none_left(before)
