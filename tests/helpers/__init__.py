"""What the tests share and only the tests use: fakes of the gateway's parts, the `polar` command as a
user runs it, stack configs, tiny models and servers, the examples loaded as modules, and the harness
programs a node runs in the rollout tests. Fakes meant for users' own tests are polar.testing."""
