"""`python -m gateway`: the gateway service as itself (`stagecast gateway` is the same command)."""

from stagecast.service import service_main

if __name__ == "__main__":
    service_main("gateway")
