"""Capture: the training step as one functionalised ATen graph (torch.export, then AOTAutograd's joint graph), kept
on disk between runs (capture_store), grouped into the planning nodes the schedule acts on (planning_graph), with
the autocast regions it ran under and the feeds that map a call's tensors onto the graph's inputs. Shapes come from
fake tensors: nothing here allocates the model's activations."""
