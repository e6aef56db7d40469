"""Load testing GPU inference services, with the GPU's side of the story (`gpuscope loadtest`)."""
