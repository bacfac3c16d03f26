"""Several engine replicas behind one endpoint on Ray Serve, and prefix-affinity routing."""
