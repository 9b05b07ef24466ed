"""The reference networks' names, without torch: what a service checks a request against before estimating it."""

VGG_NAMES = ("vgg16", "vgg19", "vgg116", "vgg216", "vgg316", "vgg416")
MODEL_NAMES = VGG_NAMES + ("unet", "resnet18", "resnet50", "resnet101", "transformer")
