"""The ground every layer stands on, importing none of them: errors, file helpers, environment, registries, code
identity (codehash, identity), the Unit types, worker processes, peak memory, logging."""
