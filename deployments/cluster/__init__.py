"""What lmserve sets up around Ray on a machine: cluster environment, HAProxy, RayService rendering."""
