"""What is known about a step before it runs, read off the compiled program and the annotations: FLOPs, the
memory and communication reports, the roofline over the target compiler's HLO, the devices' figures, and the
start-up report that prints them."""
