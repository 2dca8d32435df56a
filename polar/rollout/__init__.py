"""The rollout server's side: tasks in (tasks.py, with the harness presets of harness.py and the
workspace templates of templates.py), dispatch to nodes and complete GRPO groups out (server.py,
over the SQLite store in store.py), and its client (client.py). The node that runs the sessions is
polar.app.node."""
