"""The transformer as math over Ops; receives Ops and Groups, never MPI, cupy or the environment."""
