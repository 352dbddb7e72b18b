class KVConnectorMetadata:
    pass


class KVConnectorWorkerMetadata:
    pass
