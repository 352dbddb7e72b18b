from dataclasses import dataclass, field


class KVConnectorMetadata:
    pass


class KVConnectorWorkerMetadata:
    pass


@dataclass
class KVConnectorTransferResults:
    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)
