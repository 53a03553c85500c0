"""Instances of an endpoint in discovery: the record a server registers and clients watch."""

from __future__ import annotations

import msgspec

from dynamo.runtime.naming import EndpointId


class InstanceInfo(msgspec.Struct, frozen=True, kw_only=True):
    """One registration of an endpoint (key ``v1/instances/{ns}/{comp}/{ep}/{id:x}``)."""

    namespace: str
    component: str
    endpoint: str
    instance_id: int
    address: str

    @property
    def endpoint_id(self) -> EndpointId:
        return EndpointId(self.namespace, self.component, self.endpoint)


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(InstanceInfo)


def encode_instance(info: InstanceInfo) -> bytes:
    return _encoder.encode(info)


def decode_instance(raw: bytes) -> InstanceInfo:
    return _decoder.decode(raw)
