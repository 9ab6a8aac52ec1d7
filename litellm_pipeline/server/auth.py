"""API keys: ``Authorization: Bearer KEY`` -> the tenant of ``conf/tenants`` that owns the key.

Only SHA-256 digests are kept: the config holds digests (``api_key_sha256``) or names an environment variable
that holds a key (``api_key_env``, read and hashed once, at start). A presented key is hashed and compared with
every known digest by :func:`hmac.compare_digest`, without stopping at a match, so the time taken says nothing
about which digest (or how much of one) matched. Authentication is the server's alone; quotas and fair shares
apply to the tenant name in the engine, whatever the front end.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from typing import Mapping

from fastapi import Request

from litellm_pipeline.config.schema import TenantSection
from litellm_pipeline.errors import AuthenticationError, ConfigError

__all__ = ["ApiKeys", "digest"]


def digest(key: str) -> str:
    """The SHA-256 hex digest of a key (what ``api_key_sha256`` lists)."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


class ApiKeys:
    """``tenant_of`` for :func:`~litellm_pipeline.server.app.build_app`: the tenant whose key the request bears,
    else :class:`AuthenticationError` (401)."""

    def __init__(self, digests: Mapping[str, str]):
        # (digest bytes, tenant): bytes so compare_digest compares equal-length values
        self._known = [(bytes.fromhex(d), tenant) for d, tenant in digests.items()]

    @classmethod
    def from_config(cls, tenants: Mapping[str, TenantSection], environ: Mapping[str, str] | None = None) -> ApiKeys:
        """The keys of ``conf/tenants``; ConfigError naming the key path for an unset or empty environment
        variable, a key given to two tenants, or a config where no tenant has a key at all."""
        environ = os.environ if environ is None else environ
        owner: dict[str, str] = {}  # digest -> the key path that gave it
        tenant_of: dict[str, str] = {}  # digest -> tenant
        for name, t in tenants.items():
            found = [(f"tenants.{name}.api_key_sha256[{i}]", d) for i, d in enumerate(t.api_key_sha256)]
            if t.api_key_env is not None:
                key = environ.get(t.api_key_env, "")
                if not key.strip():
                    raise ConfigError(f"tenants.{name}.api_key_env: the environment variable {t.api_key_env} is not "
                                      "set (or empty): set it to the tenant's API key")
                found.append((f"tenants.{name}.api_key_env", digest(key.strip())))
            for path, d in found:
                if d in owner and owner[d] != path:
                    raise ConfigError(f"{path}: the same key as {owner[d]}: a key must name one tenant")
                owner[d], tenant_of[d] = path, name
        if not owner:
            raise ConfigError("tenants: no tenant has an API key (api_key_sha256 or api_key_env), so the server "
                              "would refuse every request; give one a key, or use tenants=open")
        return cls(tenant_of)

    def __len__(self) -> int:
        return len(self._known)

    def tenant(self, key: str) -> str | None:
        """The tenant owning ``key``, or None; constant time in which digest matches."""
        presented = hashlib.sha256(key.encode("utf-8")).digest()
        match = None
        for known, tenant in self._known:
            if hmac.compare_digest(presented, known):
                match = tenant
        return match

    def __call__(self, request: Request) -> str:
        header = request.headers.get("authorization")
        if header is None:
            raise AuthenticationError("no API key: send it in the header 'Authorization: Bearer <key>'")
        scheme, _, key = header.strip().partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            raise AuthenticationError("the Authorization header must be 'Bearer <key>'")
        tenant = self.tenant(key)
        if tenant is None:
            raise AuthenticationError("invalid API key")  # never echo the key
        return tenant
