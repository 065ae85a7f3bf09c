
module @m {
  func.func @main(%arg0: tensor<1024xf32> {mhlo.memory_kind = "pinned_host"}, %arg1: tensor<1024xf32>)
      -> (tensor<1024xf32> {mhlo.memory_kind = "pinned_host"}) {
    %0 = stablehlo.custom_call @annotate_device_placement(%arg0) {has_side_effect = true, mhlo.frontend_attributes = {_xla_buffer_placement = "device"}} : (tensor<1024xf32>) -> tensor<1024xf32>
    %1 = stablehlo.add %0, %arg1 : tensor<1024xf32>
    %2 = stablehlo.custom_call @annotate_device_placement(%1) {has_side_effect = true, mhlo.frontend_attributes = {_xla_buffer_placement = "pinned_host"}} : (tensor<1024xf32>) -> tensor<1024xf32>
    return %2 : tensor<1024xf32>
  }
}
