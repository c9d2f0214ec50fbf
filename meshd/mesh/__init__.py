"""One view of the mesh, built from the signed membership records (``view``), the connections made on
demand for it (``links``), and the operator console that shows it (``console``, ``events``)."""
