"""Which API process of a scheduler shard a connection reached: the initial metadata a shard's
`GetModelInfo` answers with (scheduler_svc/api_server.py) and a caller balancing its streams
over the processes reads (gateway/shard_routing.py). Here on the ground floor, because the
gateway imports no scheduler internals."""

PROCESS_KEY = "x-llmesh-api-process"  # this process's id
PROCESSES_KEY = "x-llmesh-api-processes"  # how many API processes the shard runs
