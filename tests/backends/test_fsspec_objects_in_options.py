"""The fsspec backend serves every fsspec protocol, and some take objects in their options
(gcsfs's ``token``: a dict of service-account info, or a credentials object): only s3's
credentials are checked for text, so such a store still builds."""
import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from hicache.storage import create_async_storage


class TokenFS(MemoryFileSystem):
    """Stands in for gcsfs: ``token`` may be a dict (service-account info)."""
    protocol = "tokenfs"

    def __init__(self, token=None, **kw):  # type: ignore[no-untyped-def]
        assert token is None or isinstance(token, (str, dict))
        super().__init__(**kw)


fsspec.register_implementation("tokenfs", TokenFS, clobber=True)


def test_a_dict_token_is_accepted() -> None:
    info = {"type": "service_account", "project_id": "p", "private_key": "-----BEGIN..."}
    store = create_async_storage("fsspec", None, url="tokenfs://bucket/prefix", storage_options={"token": info})
    assert store is not None
