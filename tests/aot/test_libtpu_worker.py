"""The compiler process's text handling, without the compiler: the donations a module
header carries, and the figures of a refusal."""
from xla_fsdp.aot.libtpu_worker import donors_in_header, oom_figures


def test_donors_from_buffer_donor_and_from_input_output_alias():
    donor = "HloModule m, buffer_donor={ (0, {}), (2, {}), (11, {}) }, entry_computation_layout={()->()}\n"
    alias = ("HloModule m, input_output_alias={ {0}: (3, {}, may-alias), {1}: (5, {}, "
             "must-alias) }, entry_computation_layout={()->()}\n")
    assert donors_in_header(donor + "ENTRY ...") == [0, 2, 11]
    assert donors_in_header(alias) == [3, 5]
    assert donors_in_header("HloModule m, entry_computation_layout={()->()}\n") == []
    assert donors_in_header("HloModule m\n%p = f32[] parameter(0), buffer_donor={ (1, {}) }") == []


def test_the_figures_of_an_out_of_memory_refusal():
    message = ("RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: Ran out of memory on HBM, the "
               "total memory required for HLO temporaries (25.60G) exceeds available HBM "
               "(15.75G). HLO module: IrToHlo.43100.")
    figures = oom_figures(message)
    assert figures == {"required_bytes": int(25.6 * 2 ** 30),
                       "available_bytes": int(15.75 * 2 ** 30),
                       "required_for": "HLO temporaries"}
    assert oom_figures("INVALID_ARGUMENT: something else") == {}
