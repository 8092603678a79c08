"""The runtime wing: init and shutdown, the world, process sets, topology, observation."""
