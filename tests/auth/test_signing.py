import hashlib
import stat
import time

import pytest

from gpuflex.auth.signing import HEADER_NODE, NodeKey, node_id_for, signed_request
from gpuflex.errors import Unauthorized


def _verify(key: NodeKey, headers, *, method="POST", path="/v1/nodes/lease", body=b"{}", now=None, skew=60.0):
    return signed_request(
        key.public_key_hex,
        method,
        path,
        hashlib.sha256(body).hexdigest(),
        headers,
        now=time.time() if now is None else now,
        max_skew_s=skew,
    ).verify()


def test_a_signed_request_verifies_and_names_its_node():
    key = NodeKey.generate()
    headers = key.sign_request("POST", "/v1/nodes/lease", b"{}")
    assert _verify(key, headers) == headers["X-GPUFlex-Nonce"]
    assert headers[HEADER_NODE] == node_id_for(key.public_key_hex) == key.node_id


@pytest.mark.parametrize("change", [{"method": "GET"}, {"path": "/v1/nodes/leave"}, {"body": b'{"x":1}'}])
def test_any_change_breaks_the_signature(change):
    key = NodeKey.generate()
    headers = key.sign_request("POST", "/v1/nodes/lease", b"{}")
    with pytest.raises(Unauthorized, match="bad request signature"):
        _verify(key, headers, **change)


def test_another_key_cannot_sign_for_a_node():
    key, impostor = NodeKey.generate(), NodeKey.generate()
    headers = impostor.sign_request("POST", "/v1/nodes/lease", b"{}")
    with pytest.raises(Unauthorized):
        _verify(key, headers)


def test_stale_and_malformed_requests_are_refused():
    key = NodeKey.generate()
    headers = key.sign_request("POST", "/v1/nodes/lease", b"{}")
    with pytest.raises(Unauthorized, match="timestamp"):
        _verify(key, headers, now=time.time() + 120)
    with pytest.raises(Unauthorized, match="missing or malformed"):
        _verify(key, {k: v for k, v in headers.items() if k != "X-GPUFlex-Signature"})


def test_key_is_made_once_private_and_reloaded(tmp_path):
    path = tmp_path / "agent" / "node.key"
    first = NodeKey.load_or_create(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert NodeKey.load_or_create(path).public_key_hex == first.public_key_hex


def test_a_sealing_key_is_checked_against_the_nodes_own_signature_and_id():
    from gpuflex.auth.signing import check_sealing_key, sign_sealing_key

    node, other = NodeKey.generate(), NodeKey.generate()
    sealing = "ab" * 32
    signed = sign_sealing_key(node, sealing)
    check_sealing_key(node.node_id, node.public_key_hex, sealing, signed)
    with pytest.raises(Unauthorized, match="did not sign this sealing key"):
        check_sealing_key(node.node_id, node.public_key_hex, "cd" * 32, signed)  # a key swapped in
    with pytest.raises(Unauthorized, match="does not hash to its id"):  # another node's key, and its word
        check_sealing_key(node.node_id, other.public_key_hex, sealing, sign_sealing_key(other, sealing))
