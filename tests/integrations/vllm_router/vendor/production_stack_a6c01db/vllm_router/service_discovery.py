# Not production-stack's: a stand-in for src/vllm_router/service_discovery.py (which needs the
# kubernetes client), with its EndpointInfo's fields and a static discovery the test fills.
from dataclasses import dataclass
from typing import List, Optional


@dataclass
class EndpointInfo:
    url: str
    model_names: List[str]
    Id: str
    added_timestamp: float
    model_label: str
    sleep: bool
    healthy: bool = True


class StaticServiceDiscovery:
    def __init__(self, endpoints: List[EndpointInfo]):
        self.endpoints = endpoints

    def get_endpoint_info(self) -> List[EndpointInfo]:
        return list(self.endpoints)


_discovery: Optional[StaticServiceDiscovery] = None


def initialize_service_discovery(endpoints: List[EndpointInfo]) -> StaticServiceDiscovery:
    global _discovery
    _discovery = StaticServiceDiscovery(endpoints)
    return _discovery


def get_service_discovery() -> StaticServiceDiscovery:
    assert _discovery is not None, "initialize_service_discovery first"
    return _discovery
