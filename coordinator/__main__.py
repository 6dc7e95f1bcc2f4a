"""`python -m coordinator`: the coordinator service as itself (`stagecast coordinator` is the same command)."""

from stagecast.log import quiet_grpc_core

quiet_grpc_core()  # before grpc loads

from stagecast.service import service_main  # noqa: E402

if __name__ == "__main__":
    service_main("coordinator")
