"""The Ray control plane: placement of routers, target and draft replicas, supervision
and scaling."""
